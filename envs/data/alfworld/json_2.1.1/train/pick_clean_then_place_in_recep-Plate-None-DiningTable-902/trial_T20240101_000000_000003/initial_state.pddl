(define (problem plan_trial_T20240101_000000_000003)
(:domain alfred)
(:objects
    agent1 - agent
    Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Mug_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 - object
    Plate_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Spoon_bar__plus_06_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    AppleType - otype
    BreadType - otype
    ButterKnifeType - otype
    KnifeType - otype
    MugType - otype
    PlateType - otype
    SpoonType - otype
    TomatoType - otype
    CabinetType - rtype
    CounterTopType - rtype
    DiningTableType - rtype
    FridgeType - rtype
    MicrowaveType - rtype
    SinkBasinType - rtype
    CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Cabinet_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Cabinet_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Fridge_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Microwave_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Sink_bar__plus_06_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25_bar_SinkBasin - receptacle
    DiningTable_bar__plus_07_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    loc_bar_0_bar_0_bar_0_bar_0 - location
    loc_bar_1_bar_1_bar_1_bar_45 - location
    loc_bar_2_bar_2_bar_1_bar_45 - location
    loc_bar_3_bar_3_bar_1_bar_45 - location
    loc_bar_4_bar_4_bar_1_bar_45 - location
    loc_bar_5_bar_5_bar_1_bar_45 - location
    loc_bar_6_bar_6_bar_1_bar_45 - location
    loc_bar_7_bar_7_bar_1_bar_45 - location
)
(:init
    (receptacleType CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 CounterTopType)
    (receptacleAtLocation CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (objectType Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 AppleType)
    (inReceptacle Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (pickupable Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (heatable Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (coolable Apple_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (objectType Mug_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 MugType)
    (inReceptacle Mug_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 CounterTop_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Mug_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (pickupable Mug_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25)
    (receptacleType Cabinet_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 CabinetType)
    (receptacleAtLocation Cabinet_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (openable Cabinet_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectType Plate_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 PlateType)
    (inReceptacle Plate_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Cabinet_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Plate_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (pickupable Plate_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (cleanable Plate_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType Cabinet_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 CabinetType)
    (receptacleAtLocation Cabinet_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_3_bar_3_bar_1_bar_45)
    (openable Cabinet_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (receptacleType Fridge_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 FridgeType)
    (receptacleAtLocation Fridge_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_4_bar_4_bar_1_bar_45)
    (openable Fridge_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectType Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 TomatoType)
    (inReceptacle Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Fridge_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_4_bar_4_bar_1_bar_45)
    (pickupable Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (coolable Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (heatable Tomato_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType Microwave_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 MicrowaveType)
    (receptacleAtLocation Microwave_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_5_bar_5_bar_1_bar_45)
    (openable Microwave_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (receptacleType Sink_bar__plus_06_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25_bar_SinkBasin SinkBasinType)
    (receptacleAtLocation Sink_bar__plus_06_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25_bar_SinkBasin loc_bar_6_bar_6_bar_1_bar_45)
    (objectType Spoon_bar__plus_06_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 SpoonType)
    (inReceptacle Spoon_bar__plus_06_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Sink_bar__plus_06_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25_bar_SinkBasin)
    (objectAtLocation Spoon_bar__plus_06_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_6_bar_6_bar_1_bar_45)
    (pickupable Spoon_bar__plus_06_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (cleanable Spoon_bar__plus_06_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType DiningTable_bar__plus_07_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 DiningTableType)
    (receptacleAtLocation DiningTable_bar__plus_07_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_7_bar_7_bar_1_bar_45)
    (objectType Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 BreadType)
    (inReceptacle Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 DiningTable_bar__plus_07_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_7_bar_7_bar_1_bar_45)
    (pickupable Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (heatable Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (coolable Bread_bar__plus_07_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (canContain CabinetType AppleType)
    (canContain CabinetType BreadType)
    (canContain CabinetType MugType)
    (canContain CabinetType PlateType)
    (canContain CabinetType SpoonType)
    (canContain CabinetType TomatoType)
    (canContain CounterTopType AppleType)
    (canContain CounterTopType BreadType)
    (canContain CounterTopType MugType)
    (canContain CounterTopType PlateType)
    (canContain CounterTopType SpoonType)
    (canContain CounterTopType TomatoType)
    (canContain DiningTableType AppleType)
    (canContain DiningTableType BreadType)
    (canContain DiningTableType MugType)
    (canContain DiningTableType PlateType)
    (canContain DiningTableType SpoonType)
    (canContain DiningTableType TomatoType)
    (canContain FridgeType AppleType)
    (canContain FridgeType BreadType)
    (canContain FridgeType MugType)
    (canContain FridgeType PlateType)
    (canContain FridgeType SpoonType)
    (canContain FridgeType TomatoType)
    (canContain MicrowaveType AppleType)
    (canContain MicrowaveType BreadType)
    (canContain MicrowaveType MugType)
    (canContain MicrowaveType PlateType)
    (canContain MicrowaveType SpoonType)
    (canContain MicrowaveType TomatoType)
    (canContain SinkBasinType AppleType)
    (canContain SinkBasinType BreadType)
    (canContain SinkBasinType MugType)
    (canContain SinkBasinType PlateType)
    (canContain SinkBasinType SpoonType)
    (canContain SinkBasinType TomatoType)
    (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)
)
(:goal (exists (?r - receptacle) (exists (?o - object) (and (cleanable ?o) (objectType ?o PlateType) (receptacleType ?r DiningTableType) (isClean ?o) (inReceptacle ?o ?r)))))
)
